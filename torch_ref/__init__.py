"""PyTorch references for jaxmem: twin models, weight transfer and the four techniques.

- :mod:`torch_ref.models`, :mod:`torch_ref.convert` — twin zoo and exact weight transfer.
- :mod:`torch_ref.measure`  — saved-tensor bytes and measured peaks in PyTorch.
- :mod:`torch_ref.memsave`  — selective differentiation (memory-saving layers).
- :mod:`torch_ref.fewbit`   — few-bit activations sharing jaxmem's tables.
- :mod:`torch_ref.rowconv`  — row-centric convolution training.
- :mod:`torch_ref.olla`     — torch.fx importer for jaxmem.schedule.
- :mod:`torch_ref.losses`   — the LM head's cross-entropy a chunk of tokens at a time.

Needs the ``torch`` extra: ``pip install 'jaxmem[torch]'``.
"""
