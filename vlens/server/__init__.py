"""`vlens serve`: an OpenAI-compatible HTTP server whose requests can also return activations.

app.py holds the routes (`create_app`, `serve`), generate.py turns a request into engine work and a
response, engine_loop.py runs the engine on its own thread, activations.py bounds, encodes and stores
captured tensors, and auth.py, limits.py and metrics.py are the middleware around it all. Nothing is
imported here, so `vlens` commands other than serve never load the web stack.
"""
