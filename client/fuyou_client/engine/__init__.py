"""The engine: ``attach`` and ``attach_frozen`` (attach.py), the one place that builds an Engine's parts
(build.py), the Engine's API (engine.py), the hooks on the model (hooks.py), attach's
options (options.py), the torch-optimizer face (torch_optimizer.py) and an optimizer
host's engine and command loop (serve.py: ``serve_optimizer``)."""
from fuyou_client.engine.attach import attach, attach_frozen
from fuyou_client.engine.engine import Engine
from fuyou_client.engine.options import AttachOptions
from fuyou_client.engine.serve import Served, serve_optimizer

__all__ = ["attach", "attach_frozen", "Engine", "AttachOptions", "serve_optimizer", "Served"]
