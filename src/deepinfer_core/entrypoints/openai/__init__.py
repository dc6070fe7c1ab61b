"""An OpenAI-compatible HTTP server over ``AsyncLLM`` (``deepinfer serve``; docs/engine.md, "Serving").

``protocol`` (request checks, OpenAI error objects), ``serving`` (the endpoints' logic), ``metrics``
(Prometheus text) import without the ``serve`` extra; ``api_server.build_app`` / ``serve`` need FastAPI and
uvicorn (``pip install "deepinfer-components[serve]"``) and import them when called.
"""
