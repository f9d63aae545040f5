"""The weightplan runtime: reads plan files and executes them; never imports the compiler."""

from .errors import LayoutError, PlanFormatError, PlanMismatchError, SyncError, WeightplanError
from .host_executor import execute_local
from .live_module import LiveSender, trainer_tensors
from .plan_format import Plan, load_plan
from .receiver import Receiver, SyncReport
from .rendezvous import Rendezvous
from .sender import ReleaseReport, Sender
from .trainer_layout import read_trainer_layout, write_trainer_layout

__all__ = [
    "LayoutError", "LiveSender", "Plan", "PlanFormatError", "PlanMismatchError", "Receiver", "ReleaseReport", "Rendezvous",
    "Sender", "SyncError", "SyncReport", "WeightplanError", "execute_local", "load_plan", "read_trainer_layout",
    "trainer_tensors", "write_trainer_layout",
]
