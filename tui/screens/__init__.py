"""One screen per module: the main panels, the full log, and the small modal dialogs."""
