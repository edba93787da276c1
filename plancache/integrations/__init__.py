"""plancache inside code written for cuDNN Frontend, unchanged.

``frontend``: ``install()`` and the persisted ``cudnn.jit`` and ``cudnn.graph_cache``;
``frontend_pipeline``: the frontend's planning calls (``build_plans``, ``build``, the build
inside ``execute``) served from the cache; ``frontend_adopt``: a stored plan put into the
caller's own graph object; ``startup``: what ``PLANCACHE_PATCH_CUDNN`` does when plancache
is imported. (The interpreter start-up hook itself, ``_plancache_startup``, lives outside
the package so that it imports nothing of it until the program imports cuDNN.)

Importing this package imports no cuDNN: ``install`` and the decorators do, when called.
"""
