"""Parity checkers: one function per fixture case name, registered with :func:`checker`."""
