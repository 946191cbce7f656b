"""The OpenAI-compatible server behind ``ggml-hybrid serve`` (the ``server`` extra: ``pip install -e '.[server]'``
in the checkout; ggml-hybrid is not on PyPI).

``protocol`` (request checks, response and error shapes), ``models`` (the served models, loaded in the
background, each with an engine), ``metrics`` (Prometheus text), ``app`` (the Starlette routes).
"""
