"""The broker's pure core: the fleet view, placement and its explanation, the forecast and
demand, the waiting room's order, identity verdicts, recovery plans, and the service's own
rules, with their tunables. Synchronous functions and frozen data with ``now`` passed in;
nothing here imports asyncio, Redis, MQTT or HTTP (``tests/test_layout.py`` holds that). The
shells around it are the modules of ``broker/`` itself.
"""
