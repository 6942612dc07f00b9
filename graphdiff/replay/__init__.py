"""Re-executing what the engine ran: the FX interpreter under a rounding plan, and each generated kernel replayed
on its recorded buffers (its fusion, reloads, op forms, summation order and transcendentals as Inductor's C++)."""
