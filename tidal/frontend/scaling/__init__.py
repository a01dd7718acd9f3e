"""Elastic EP orchestration on the frontend (docs/architecture.md#elastic): the pure scale controller
(``scale_controller``), the driver that runs it against the engines and the launcher
(``scale_driver``), what it reacts to (``scale_events``) and what it records
(``scale_records``)."""
