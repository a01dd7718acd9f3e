"""Elastic EP orchestration on the frontend (DESIGN.md 6.2-6.5): the pure scale controller
(``scale_controller``), the driver that runs it against the engines and the launcher
(``scale_driver``), what it reacts to (``scale_events``) and what it records
(``scale_records``)."""
