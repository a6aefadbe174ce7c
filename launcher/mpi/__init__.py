"""MPI knowledge: the ABI table, ELF reading, the host's MPI installs, launch flavours, srun's PMI
plugins and the MPI library a process really loaded."""
