"""weightwire inside SGLang (supported: SGLang 0.5.23).

Modules, imported one by one (this package imports none of them, nor torch, nor sglang):

- `lifecycle`: an async client for SGLang's HTTP calls around a weight update
  (pause_generation, flush_cache, begin/end_weight_update, update_weight_version,
  continue_generation) and `update_weights`, which runs the whole sequence. stdlib only.
  It re-exports `client` (the calls), `update` (the sequence), `wire` (HTTP/1.1 on
  asyncio streams) and `errors`.
- `plugin`: the SGLang general plugin (entry point `sglang.srt.plugins: weightwire`).
  In every SGLang TP worker, after the model is loaded, it registers the worker's
  parameters with the local weightwired, configured by `WEIGHTWIRE_*` variables.
- `replica`: replica mode on the trainer side: SGLang's own model class built on CPU in
  an engine rank's layout, its parameters living in weightwire-registered memory, loaded
  through SGLang's own `load_weights`, published zero-copy.
- `layout`: layout keys, replica source names and the engine-side recipes that read them.
- `cpu`: build SGLang model classes on CPU without a GPU or torch.distributed (importing
  it sets SGLANG_USE_CPU_ENGINE=1: never import it in an SGLang server process).
"""

SUPPORTED_SGLANG = "0.5.23"
