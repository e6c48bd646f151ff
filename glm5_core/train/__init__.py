"""The pretraining driver behind ``glm5 pretrain`` (see ``glm5_core.train.trainer``)."""
from glm5_core.config_schema import ConfigError
from glm5_core.train.config import TrainConfig
from glm5_core.train.config_loader import load_config, parse_config
from glm5_core.train.trainer import RunOptions, pretrain

__all__ = ["ConfigError", "RunOptions", "TrainConfig", "load_config", "parse_config", "pretrain"]
