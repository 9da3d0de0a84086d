"""Rollouts for online RL: vLLM as a separate engine process (vllm_process.py, in vLLM's own environment) and the
trainer's client for it (client.py): samples with the engine's log-probs, the trainer's weights pushed into the
running engine, and the probe check that the push took."""
