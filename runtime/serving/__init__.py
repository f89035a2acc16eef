"""The HTTP server's parts: protocol models, the engine thread, the load policy, metrics, the app,
and the uvicorn server with its bounded shutdown; and, in ``ray_*.py`` (the ``serve-ray`` extra), those of
the Ray Serve replicas: the fleet board, one replica, Serve's proxy, a deployment and Ray around it.

Entry points: ``python -m runtime.serve PATH`` (:mod:`runtime.serve`) and ``python -m runtime.serve_ray PATH``
(:mod:`runtime.serve_ray`).
"""
