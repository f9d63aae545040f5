"""The weightplan runtime: reads plan files and executes them; never imports the compiler."""

from .errors import LayoutError, PlanFormatError, PlanMismatchError, SyncError, WeightplanError
from .host.executor import execute_local
from .layout.layout_file import read_trainer_layout, write_trainer_layout
from .layout.module_tensors import trainer_tensors
from .layout.stage_merge import merge_stage_layouts, write_pipeline_layout
from .plan.format import Plan, load_plan
from .options import SyncOptions
from .receiver.receiver import Receiver
from .receiver.report import ReceiverStats, SyncReport
from .sender.live_module import LiveSender
from .sender.release import ReleaseReport
from .sender.sender import Sender
from .transport.rendezvous import Rendezvous

__all__ = [
    "LayoutError", "LiveSender", "Plan", "PlanFormatError", "PlanMismatchError", "Receiver", "ReceiverStats", "ReleaseReport",
    "Rendezvous", "Sender", "SyncError", "SyncOptions", "SyncReport", "WeightplanError", "execute_local", "load_plan", "merge_stage_layouts",
    "read_trainer_layout", "trainer_tensors", "write_pipeline_layout", "write_trainer_layout",
]
