"""The HTTP server's parts: protocol models, the engine thread, the load policy, metrics, the app.

Entry point: ``python -m runtime.serve PATH`` (:mod:`runtime.serve`).
"""
