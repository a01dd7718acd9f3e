"""Elastic expert parallelism (DESIGN.md 6): the scale plan, the engine-side
``ElasticEPScalingState`` and expert transfer. The process groups it builds on are in
``tidal.distributed``."""
