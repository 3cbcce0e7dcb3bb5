"""Publishing policy versions: writing a trained adapter or checkpoint where every model server can
read it, loading it into each, and promoting or rolling back the ``policy`` alias. The pool keeps
the version rows (``datapool.versions``); the model servers are reached through ``vllm_client``.
The trainer, the CLI and the admin API all publish through here."""
