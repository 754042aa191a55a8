"""The operator's console: a live dashboard served by the broker, its viewers and operators,
and the actions they take (``docs/console.md``).

``auth`` (users, tokens, sessions), ``holds`` (drain, cordon, pause: the pure rules; a
dead letter's release is ``board``'s, through ``broker.inflight``),
``figures`` (per line and per pool over a sliding window), ``snapshot`` (the dashboard's
document), ``board`` (the shell that feeds and serves them), ``routes`` (aiohttp) and
``access`` (who may use a broker's views, from its settings). The package itself imports
nothing: the ``sluicegate console`` commands need ``auth`` alone, not aiohttp.
"""
