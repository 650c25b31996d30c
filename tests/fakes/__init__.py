"""Fakes of the servers tokenway talks to, speaking their real wire over real HTTP: vLLM's
token-only engine (`vllm_engine`) and its render/derender server (`vllm_render`)."""
