"""The HTTP server's parts: protocol models, the engine thread, the load policy, metrics, the app,
and the uvicorn server with its bounded shutdown.

Entry point: ``python -m runtime.serve PATH`` (:mod:`runtime.serve`).
"""
