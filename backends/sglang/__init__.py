"""SGLang backend (env "sglang"): engine actor, trainer worker, and the loader SGLang runs."""
