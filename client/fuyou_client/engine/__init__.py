"""The engine: ``attach`` (attach.py), the one place that builds an Engine's parts
(build.py), the Engine's API (engine.py), the hooks on the model (hooks.py), attach's
options (options.py) and the torch-optimizer face (torch_optimizer.py)."""
from fuyou_client.engine.attach import attach
from fuyou_client.engine.engine import Engine
from fuyou_client.engine.options import AttachOptions

__all__ = ["attach", "Engine", "AttachOptions"]
