"""What the Python benchmark scripts of bench/ share (they import it from their own folder)."""


def free_ports(n):
    """n ports of 127.0.0.1 for the tasks a script starts (reserved while the script runs)."""
    import tensorverbs  # here: the scripts' task processes import it after their own set-up

    return tensorverbs.free_ports(n)
