"""Everything vlens does at a tap, in one package: what a request asks for (spec, positions,
interventions), hook names, binding a request to the model (bind), its rows as they arrive (rows), the
per-step plan of plain tensors (plan), the taps the model calls (runtime) and on-device readouts.

The path of one captured row: Capture (spec) -> RequestTaps (bind) -> StepPlan (plan, each step) ->
Tap.__call__ in the forward (runtime) -> TapRuntime.collect -> RowStream.add (rows) -> RowStream.result.
"""

from vlens.capture.interventions import Ablate, Clamp, Patch, Steer
from vlens.capture.positions import Positions
from vlens.capture.spec import Capture
from vlens.capture.tuned_lens import TunedLens

__all__ = ["Ablate", "Capture", "Clamp", "Patch", "Positions", "Steer", "TunedLens"]
