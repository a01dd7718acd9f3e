"""Where engine processes run (docs/architecture.md#launchers): the ``Launcher`` ABC (``base``), ``mp`` (local
processes, the warm zygote; other hosts run ``launch --headless``) and ``ray`` (actors in
placement groups; the only Ray import), chosen by ``--data-parallel-backend``
(``registry``: each backend's ``LauncherKind``, what it can do and its flags' rules, and
``make_launcher``); the engine process manager (``proc_manager``: the startup handshake,
watching and stopping ranks, whichever launcher started them)."""
