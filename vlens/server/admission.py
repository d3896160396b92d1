"""What the server takes on at once: a bound on requests held (running or queued in the engine) and on
capture bytes (the bounds of admitted capture requests plus the activation handles not yet downloaded).

Past either bound a request is refused with 429 and `Retry-After` before it reaches the engine, so a
burst of clients or of large captures queues only as far as memory allows and the server recovers as
soon as requests finish. While the server shuts down, new requests get 503.
"""

from __future__ import annotations

from dataclasses import dataclass

from vlens.server.activations import ActivationStore
from vlens.server.protocol import APIError

RETRY_AFTER_S = 1  # requests finish in seconds; a handle download frees its bytes at once


@dataclass
class Ticket:
    """One admitted HTTP request: what it holds until `Admission.release`."""

    requests: int
    capture_bytes: int
    released: bool = False


class Admission:
    """Counts what admitted requests hold. Only the event-loop thread calls it, so it needs no lock."""

    def __init__(self, max_requests: int, max_capture_bytes: int, store: ActivationStore):
        self.max_requests, self.max_capture_bytes, self.store = max_requests, max_capture_bytes, store
        self.requests = 0
        self.capture_bytes = 0  # reserved by admitted requests, stored handles not counted
        self.closing = False

    def admit(self, requests: int, capture_bytes: int, field: str) -> Ticket:
        """A ticket for `requests` engine requests (the prompts of request field `field`) that may return
        `capture_bytes`; APIError 429 (503 while shutting down) if the server holds too much, 400 if the
        prompts alone are more than it ever holds. A capture larger than the whole budget still runs, alone:
        refusing it forever would help no one, and its size is already bounded per request."""
        if self.closing:
            raise APIError(503, "the server is shutting down; retry on another instance", code="shutting_down",
                           headers={"Retry-After": str(RETRY_AFTER_S)})  # fmt: skip
        if requests > self.max_requests:  # (a 429 would be retried forever)
            raise APIError(400, f"{field}: {requests} prompts in one request, more than this server's "
                                f"--max-pending-requests ({self.max_requests}); send them in smaller requests",
                           param=field)  # fmt: skip
        if self.requests and self.requests + requests > self.max_requests:
            raise self._busy(f"{self.requests} requests are running or queued, this server's --max-pending-requests")
        self.store.sweep()  # expired handles hold nothing any more
        held = self.capture_bytes + self.store.nbytes
        if capture_bytes and held and held + capture_bytes > self.max_capture_bytes:
            raise self._busy(
                f"{held} bytes of activations are in flight or awaiting download; this request could add "
                f"{capture_bytes}, over --max-capture-bytes-in-flight of {self.max_capture_bytes}"
            )
        self.requests += requests
        self.capture_bytes += capture_bytes
        return Ticket(requests, capture_bytes)

    def release(self, ticket: Ticket) -> None:
        if not ticket.released:
            ticket.released = True
            self.requests -= ticket.requests
            self.capture_bytes -= ticket.capture_bytes

    @staticmethod
    def _busy(why: str) -> APIError:
        return APIError(
            429, f"server busy: {why}; retry after {RETRY_AFTER_S} s", code="server_busy",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )  # fmt: skip
