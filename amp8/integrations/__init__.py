"""amp8 inside the trainers people use: small adapters, one module per trainer.

Hugging Face ``transformers.Trainer`` and Lightning need none: pass the model and the
optimizer ``amp8.initialize`` returns, and their ``zero_grad`` and gradient clipping see
the FP8 weight gradients in ``weight.grad`` (see README, "Using amp8 with..."). Modules
here import nothing from a trainer until called, so ``import amp8`` stays light.

- ``amp8.integrations.accelerate``: ``synchronize_gradients(optimizer)``, which averages
  the FP8 weight gradients over the ranks before ``accelerator.clip_grad_norm_``.
"""
