"""Enrollment: how a new line PC, pool worker or broker replica gets its identity.

The operator makes a short-lived, single-use join token scoped to one node id, role and
zone (``token``); on the new node, one command makes the node's key, proves it holds the
token without sending its secret, obtains its certificate and the campus CA, pins the
policy's trust anchor that the token names, and writes its configuration (``client``);
the broker checks and records every request, and audits every issue and refusal
(``authority``, served by the broker's HTTP API).
"""
