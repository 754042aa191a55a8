"""``sluicegate doctor``: is this node set up to serve, and if not, what is the fix?

:mod:`~sluicegate.doctor.judge` holds the judgements (pure, over the facts of
:mod:`~sluicegate.doctor.facts`, with the clock passed in); :mod:`~sluicegate.doctor.gather`
and :mod:`~sluicegate.doctor.probe` find the facts (files, sockets, TLS, HTTP, one MQTT
login); :mod:`~sluicegate.doctor.run` orders the checks; :mod:`~sluicegate.doctor.cli` is the
command. Doctor never changes a node's state and never logs in as a node that is running.
The package itself imports nothing, so the command line starts without the checks.
"""
