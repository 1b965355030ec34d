"""The training core every command shares: typed settings, run folders, checkpoints, metrics,
learning-rate schedules, devices, ``torchrun`` process groups and the one training loop.

A command contributes a :class:`~flowattn.training.loop.Task` (its model, batches, loss,
validation and final report) and a :class:`~flowattn.training.config.RunConfig`; everything
else is done here, the same way for all. Submodules are imported where they are used (this
package imports no torch by itself).
"""

__all__: list[str] = []
