"""Framework runtimes a Selection delegates to: ``tensorflow.TfRuntime`` and ``torch.TorchRuntime``.

Each module imports its framework lazily, inside functions, so importing this package (or
either module) never starts a framework runtime or touches a GPU.
"""
