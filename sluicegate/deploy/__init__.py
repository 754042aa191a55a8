"""Installing a Sluicegate node as a hardened systemd service.

:mod:`~sluicegate.deploy.layout` says where each file of an installed role lives,
:mod:`~sluicegate.deploy.units` renders the unit and the sysusers entry,
:mod:`~sluicegate.deploy.configs` fills the commented config templates, and
:mod:`~sluicegate.deploy.installer` writes them (idempotently) and removes them; its
:func:`~sluicegate.deploy.installer.install` and
:func:`~sluicegate.deploy.installer.prepare_state_dir` are what enrollment calls. The
renderers are pure; only the installer touches files or runs commands. Nothing is
imported here, so the ``sluicegate`` command stays quick to start.
"""
