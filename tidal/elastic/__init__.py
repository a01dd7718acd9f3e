"""Elastic expert parallelism (docs/architecture.md#elastic): the scale plan, the engine-side
``ElasticEPScalingState`` and expert transfer. The process groups it builds on are in
``tidal.distributed``."""
