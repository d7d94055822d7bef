"""KIVI pages inside vLLM's CPU engine: the vLLM adapter of :mod:`kivi_xpu.paged`.

Installed as a ``vllm.general_plugins`` entry point (:func:`kivi_xpu.vllm.plugin.register`), off unless
``--additional-config '{"kivi": {...}}'`` asks for it (the keys: ``KiviCache``'s settings, see :mod:`.plan`). Then:

* :mod:`.plan` checks the vLLM version, the model and the settings at start-up, and splits the KV budget between
  vLLM's blocks (2-bit pages) and the plugin's exact units;
* :mod:`.backend` is the attention backend vLLM's CPU platform runs: pages sized by ``customize_spec``, each layer
  stored and attended by the engine-neutral core (:mod:`kivi_xpu.paged.store`, :mod:`kivi_xpu.paged.attend`);
* :mod:`.requests` lends each request in flight its exact units and takes them back when vLLM frees or preempts it.

This package is the only place that touches vLLM's internals.
"""
