"""Elastic EP orchestration on the frontend (docs/architecture.md#elastic): the pure scale controller
(``scale_controller``) joining the runner of one operation (``scale_runner``) and the
healing policy after rank deaths (``scale_healing``), the driver that runs it against the
engines and the launcher (``scale_driver``), what it reacts to (``scale_events``) and what
it records (``scale_records``)."""
