"""Textual dashboard (`exl3local dash`)."""
