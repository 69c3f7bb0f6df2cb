"""The driver: the modes (sync now; stream and async later) as short loops, and the pieces they drive."""
