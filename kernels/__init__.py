"""grpoflow.kernels: fused per-token log-probabilities and entropy of the chosen tokens (the entropy with its gradient
for the entropy bonus, the log-probs as the SFT loss: ``label_nll``), from the hidden states and the lm_head, without
ever holding the whole [tokens, vocabulary] logits.

:func:`grpoflow.kernels.logprobs.token_logprobs` is the entry point (the GRPO trainer's log-prob passes); it runs
one of three implementations of the same math, picked by ``grpo.logprob_impl``:

- Triton kernels for CUDA tensors (triton_logprobs.py; launch.py runs them on their tensors' GPU);
- chunked torch, on CPU in float32 (chunked_logprobs.py) and on CUDA with GEMMs in the compute dtype and float32
  accumulation (chunked_dtype.py; precision.py says which dtype);
- a reference that builds the full logits (``token_logprobs_reference``), for tests and benchmarks.

The GRPO loss itself is in grpoflow.tasks.grpo.loss, not here.

The folder installs as ``grpoflow.kernels`` and this file runs no code. From the checkout's root as working
directory (``python -m`` or ``python -c`` there puts it first on sys.path) the folder also answers to the
top-level name ``kernels``, Hugging Face's kernel-hub package that transformers and bitsandbytes probe: they then
find an empty module without a version and read it as "no kernels package" (tests/kernels/test_name_hazard.py).
With Hugging Face's ``kernels`` installed, run from another folder, through the ``grpoflow`` command, or with
``python -P`` (``PYTHONSAFEPATH=1``), which leaves the working directory off sys.path.
"""
