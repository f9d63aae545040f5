"""The weightplan runtime: reads plan files and executes them; never imports the compiler."""

from .errors import PlanFormatError, PlanMismatchError, WeightplanError
from .host_executor import execute_local
from .plan_format import Plan, load_plan

__all__ = ["Plan", "PlanFormatError", "PlanMismatchError", "WeightplanError", "execute_local", "load_plan"]
