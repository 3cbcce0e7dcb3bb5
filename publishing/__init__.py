"""Publishing policy versions: writing a trained adapter or checkpoint where every model server can
read it, loading it into each, and promoting or rolling back the ``policy`` alias — all in
:mod:`publishing.publish` (``publish``, ``promote``/``activate``, ``rollback``,
``rollback_tainted``, ``serve``). The pool keeps the version rows only (``datapool.versions``);
the model servers are reached through ``vllm_client``; the two never import each other, and this
package is the one place that uses both. The trainer, the CLI and the admin API all go through
here."""
