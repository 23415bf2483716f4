"""What the user asked: the settings schema, the files they name, the one settings path."""
