"""The composition root: what builds and starts whole processes and campuses. The
``sluicegate`` command (``cli.py``, ``acl_cli.py``), the demo and its clean-up, a campus
written to disk (``campus.py``) and run on local Mosquitto and Redis (``localcampus.py``,
``servers.py``). It puts the plumbing of ``sluicegate``, ``edge_agent``, ``broker``,
``center_pool`` and ``policies`` together; nothing there imports anything here
(``tests/test_layout.py`` holds that).
"""
