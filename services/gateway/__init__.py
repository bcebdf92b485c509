"""`asteroid-gateway`: the served model behind the HTTP API local-LLM programs speak.

OpenAI's ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions``
(streamed as server-sent events on request), turned into token ids with the
model folder's tokenizer and chat template (`services.lib.text`) and sent to
the coordinator as inference requests over the control plane, with CURVE when
the cluster has keys. HTTP clients present an API key; every body is bounded,
and a bounded number of requests is admitted at once, the rest refused at once
with 429 rather than queued without end.
"""
