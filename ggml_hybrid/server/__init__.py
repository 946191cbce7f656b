"""The OpenAI-compatible server behind ``ggml-hybrid serve`` (``pip install 'ggml-hybrid[server]'``).

``protocol`` (request checks, response and error shapes), ``models`` (the served models, loaded in the
background, each with an engine), ``metrics`` (Prometheus text), ``app`` (the Starlette routes).
"""
