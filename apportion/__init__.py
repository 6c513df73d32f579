"""apportion: a GPU-cluster scheduler that replaces priorities with GPU-time budgets.

Import names map from the repository's top-level folders:
``apportion.schemas`` (schemas/), ``apportion.core`` (core/),
``apportion.replay`` (replay/), ``apportion.services`` (services/).
"""

__version__ = "0.1.0"
