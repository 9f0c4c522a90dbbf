"""The pipeline driver: the router's side of the stage protocol.

It alone builds and reads the internal stage protos (`router.pipeline.convert`): the engine
hands it the scheduler's typed `StepPlan`s and gets typed `StepOutcome`s back. One control
channel and one `Run` stream per stage (`stage_client`), the pipeline's shape and capacity
as the stages report it (`shape`), the data-plane transport of each hop (`transports`),
and the driver that links, streams and fails over (`driver`).
"""

from router.pipeline.driver import Pipeline, PipelineState
from router.pipeline.outcome import StepOutcome
from router.pipeline.shape import PipelineError, PipelineShape, StageInfo

__all__ = ["Pipeline", "PipelineError", "PipelineShape", "PipelineState", "StageInfo",
           "StepOutcome"]
