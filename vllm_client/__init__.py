"""A typed client for vLLM's admin endpoints, so that neither the gateway nor the trainer speaks
vLLM's admin wire format itself:

- :mod:`vllm_client.adapters` lists models, loads and unloads LoRA adapters;
- :mod:`vllm_client.weights` pauses, resumes and reloads full weights in place, and keeps the
  label of the weights each server holds;
- :mod:`vllm_client.transfer` sends full weights over NCCL from a trainer's GPU (vLLM's
  weight-transfer engine) instead of a reload from disk;
- :mod:`vllm_client.tokenizer` asks vLLM's ``/tokenize`` and ``/detokenize`` (the gateway's
  Messages ``count_tokens`` and token view, the judge's prompt fitting, the teacher);
- :mod:`vllm_client.http` names servers, carries the errors and one JSON POST.

Publishing, promotion and rollback (``publishing.publish``) use this package beside the pool's
version rows; it is the pool's sibling (neither imports the other) and imports only
``base.settings`` and ``base.vocab``.

URLs. A server is named by its OpenAI base ``http://host:port/v1``
(:func:`vllm_client.http.openai_base` adds the ``/v1``); its development endpoints live at the
root (:func:`vllm_client.http.server_root` strips it).

LoRA adapters (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``, ``/v1/models``): vLLM
must run with ``--enable-lora``; a loaded adapter is listed in ``/v1/models`` with its path as
``root``.

Full weights. What vLLM (0.32, the CPU build included) offers, and what this module uses. With
``VLLM_SERVER_DEV_MODE=1`` the server mounts development endpoints at its root (not under
``/v1``); without it they answer 404:

- ``POST /pause?mode=wait|keep|abort`` — new requests are queued, not rejected. ``wait`` lets
  the running requests finish first (then clears the KV and prefix caches); ``keep`` freezes
  them where they are (they continue after ``/resume``, their KV recomputed); ``abort`` ends
  them with ``finish_reason: "abort"``. ``POST /resume``; ``GET /is_paused``.
- ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}`` —
  every worker loads the checkpoint in *DIR* (safetensors of the same architecture) into its
  model in place (``vllm.model_executor.model_loader.reload.inplace``). It also drops the
  workers' LoRA state: adapters still listed in ``/v1/models`` are loaded again from their
  paths on their next request.
- ``POST /update_weight_version {"new_version": LABEL}`` / ``GET /weight_info`` — a label the
  engine keeps for its weights (``"default"`` after start). We set it to the version name
  after each reload, so any process can ask a server which weights it holds (after a restart
  it says ``"default"``: the weights of its ``--model``).
- vLLM 0.26.0, the build for the GPU image's torch 2.11, has dev mode (``/pause``,
  ``/collective_rpc``) but not those two routes. There the label is kept where vLLM 0.32 keeps
  it, in the serving processes, as an attribute of every worker (:data:`RPC_LABEL_ATTR`), set
  and read through ``/collective_rpc`` (``__setattr__``; ``__dir__`` then ``__getattribute__``):
  it lives exactly as long as the weights it names, and a restarted server has none, i.e.
  ``"default"``. :func:`weight_label` and :func:`reload_weights` choose the routes per server.
  vLLM 0.26 cannot reload in place while LoRA is enabled: :func:`check_reload_with_lora` refuses
  that before the server is touched.
- ``POST /weight_checker {"action": "checksum"}`` — per-parameter digests of the loaded
  weights; :func:`weights_digest` folds them into one, recorded with the version and checked
  when it is loaded again (None on a server without the route, e.g. vLLM 0.26).

vLLM's ``/sleep`` does nothing on the CPU and is not needed here.

**Security.** Dev mode also mounts ``/collective_rpc`` (any worker method), ``/reset_*``,
``/sleep`` and the weight-transfer endpoints, unauthenticated (``--api-key`` guards ``/v1``
only). Bind such a vLLM to a private address; the gateway never proxies these paths.
"""
