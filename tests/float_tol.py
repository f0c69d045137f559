"""Float tolerances derived from the computation, not from one machine's last bits: two CPUs
(or two programs on one CPU: jit and eager, another batch shape, a decode step and a full
forward) may compile the same jnp code to another summation order or blocking.

A float32 sum or dot of n terms whose magnitudes add up to A is within (n - 1) u A of the exact
value, u = 2^-24 the unit roundoff (Higham, Accuracy and Stability of Numerical Algorithms, 2nd
ed., eq. 4.4), so two summation orders differ by at most about n EPS32 A with EPS32 = 2u = 2^-23.
One rounding (an exp, a division, a cast of a float64 reference to float32) moves a value by at
most u relative. Each test's comment names n and A; tolerances that are exact by construction
(the same compiled program on the same inputs, a copy, an integer count) say so instead.
"""

EPS32 = 2.0**-23  # float32 machine epsilon, 1.19e-7; 2u


def sum_tol(n: int, magnitude: float) -> float:
    """Two float32 summation orders of n terms whose |terms| add up to `magnitude`."""
    return n * EPS32 * magnitude
