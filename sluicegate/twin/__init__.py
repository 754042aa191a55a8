"""The digital twin: record what a campus does, replay it under a change through the
production decision code, and compare (``docs/twin.md``)."""
