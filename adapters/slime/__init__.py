"""weightwire as slime's (and miles') Megatron weight-update path: an example recipe.

slime is not on PyPI, so this is a module to plug in, not a registered backend: make
`UpdateWeightFromWeightwire` the class slime's trainer actor picks for its updater, and
start each SGLang engine with `engine_env(...)` in its environment (README, "slime /
miles"). Imports torch, Megatron (when registering) and httpx (the SGLang lifecycle client);
never slime or ray (ray only when the engines are ray actors).
"""

from .rollout import call_all, engine_env, engine_urls
from .update_weight import UpdateWeightFromWeightwire, add_arguments, hf_config_of

__all__ = [
    "UpdateWeightFromWeightwire",
    "add_arguments",
    "call_all",
    "engine_env",
    "engine_urls",
    "hf_config_of",
]
