"""Straggler and dropout profiles: what each client's jobs cost on the simulator's virtual clock.

For job ``r`` of client ``c`` (``r`` counts that client's jobs: 0, 1, 2, ...) a ``Profile``
answers ``plan(c, r)``: the job's duration in virtual seconds and the fraction of the local work
the client does; ``online(c, t, updates_sent)`` says whether the client is present at virtual
time ``t``, and ``next_change`` when that may flip, so the simulator can schedule a wake-up.

Durations combine the components of the profile in a fixed way::

    duration = base_time * tier(c) * speed(c) * prod(mul draws of job (c, r)) + sum(add draws)

floored at ``1e-9 * base_time`` so a job never takes zero time. ``mul`` draws are dimensionless
factors (the default: a delay "distribution with mean 1" leaves the mean job time unchanged);
``add`` draws are virtual seconds added on top (e.g. communication).

Reproducibility: every draw comes from ``np.random.default_rng([seed, client, round, STREAM])``
with one STREAM constant per kind of draw (client-level draws use round 0, round-level draws
client 0; ``streams.py`` says why the key always has four words). Hence every strategy in a
comparison sees exactly the same stragglers, whatever order the simulator asks in.

Specs (``make_profile``): a preset name (``"tiers"``), ``"name:key=value,key=value"``, several
of those joined by ``+`` (``"tiers:mix=L1+dropout:count=5"``), a mapping ``{"name": preset,
key: value, ...}``, a mapping of presets to their keys (``{"tiers": {"mix": "L1"}, "dropout":
{"count": 5}}``), or both at once; ``base_time`` may appear as a key anywhere. In strings,
``lo..hi`` is a range and a custom tier mix is ``mix=1:0.5/3:0.5``.

Presets (``PROFILES``) and what they model:

* ``none``: every job takes ``base_time``.
* ``tiers`` (Fed-OGD, docs/algorithms/fedogd.md 2.6 and 3): a tier-P client's job takes P x base.
  ``mix`` is ``L1`` {1: 60%, 3: 20%, 5: 20%}, ``L2`` {40/30/30%, the authors' default} or ``L3``
  {20/40/40%} or a custom {P: fraction}; exact counts (largest remainder), assigned by a
  permutation seeded by ``seed`` (``assign=shuffled``) or by contiguous client index, fastest
  first, as the authors' code does (``assign=contiguous``).
* ``speed``: a per-client factor, seeded by (seed, client): log-normal with mean 1 and
  sigma 0.5 by default, or e.g. ``dist=uniform`` (1 to 3: FedDGIC's optional speed spread,
  docs/algorithms/feddgic.md 2.2).
* ``exponential`` (mean 1; FedHist's i.i.d. exponential job times, docs/algorithms/fedhist.md 1.5),
  ``lognormal`` (mean 1, std 1: the coefficient of variation of ORTHOFL's pooled RPi latencies),
  ``halfnormal`` (mean 1, loc 0: docs/algorithms/orthofl.md G11), ``uniform`` (0.5 to 1.5),
  ``pareto`` (shape 3, mean 1); generic ``delay:dist=...``. Keys: the distribution's parameters
  (below) and ``mode`` = ``mul`` (default) or ``add``.
* ``raspberry_pi`` (ORTHOFL, docs/algorithms/orthofl.md 2.3): each client gets one of the 9 measured
  RPi profiles (mean, std in seconds) at random; each job takes N(mean, std) x base_time seconds,
  non-positive draws replaced by the mean as in the authors' code (docs/algorithms/orthofl.md G12).
* ``rpi_lognormal``, ``rpi_halfnormal``, ``rpi_uniform`` (ORTHOFL App. B.4, Fig. 6): the three
  alternative distributions parameterised by the pooled RPi statistics, in seconds.
* ``dropout`` (FedDGIC, docs/algorithms/feddgic.md 2.2 and 5 #29): ``fraction`` 0.25 of the clients
  (5 of 20) leave after a number of their own updates drawn from 4..20 (after the n_cal = 3 grouping
  rounds, within the first 20% of 100 epochs), permanently unless ``return_after`` is set.
  Keys: who leaves, as ``count``, ``fraction`` or an explicit ``clients`` list; ``choose`` (with
  ``count``/``fraction``) = ``random`` (the default: drawn uniformly) or ``label`` (a label L is
  drawn, and the clients holding the most of L leave, so L becomes rare: ``dropout.py`` gives the
  exact rule; it needs the data split, which the simulator passes as ``label_counts``); when, as
  ``at_time`` (virtual seconds) or ``after_updates`` (the client's own updates), a value or a
  ``lo..hi`` range drawn per client; ``return_after`` (virtual seconds away, or never).
* ``partial_work`` (FedEN, docs/algorithms/feden.md 1.8 and 2): a ``fraction`` 0.1 of the clients
  are stragglers in each round and do E_i ~ UniformInt{1..E-1} of E = ``units`` = 10 epochs; they
  still take the full job time (they are not late, they stop early).
* ``trace`` (``trace:file=FILE``): the timing of real clients, recorded by ``aggsrv serve
  --trace FILE``: each recorded client's job durations, the time it joined, its absences
  between an update and its next job, and whether it left for good; simulated clients beyond
  the recorded ones draw their durations from all recorded ones. Keys: ``file``, ``scale``
  (multiplies every recorded time, default 1), ``gone_after`` (a client silent for more than
  this many of its median job durations at the trace's end has left, default 3). Durations are
  recorded seconds (``base_time`` does not apply), and it is the profile's only component
  (``trace_replay.py``).

Distribution parameters (all draws are clipped at 0): ``exponential``: ``mean`` | ``rate``;
``lognormal``: ``mean`` | ``mu`` and ``std`` | ``sigma`` (mean and std map to the log-space
parameters as in docs/algorithms/orthofl.md App. B.4); ``halfnormal``: ``mean`` | ``scale``,
optional ``std`` (moment matching with a shift, docs/algorithms/orthofl.md G11's alternative);
``uniform``: ``low``, ``high``; ``pareto``: ``shape`` and ``mean`` | ``scale`` (the minimum). They
are ``scipy.stats``' ``expon``, ``lognorm``, ``halfnorm``, ``uniform`` and ``pareto``
(``distributions.py``).

The modules: ``profile`` (``Profile``, ``make_profile``, ``JobPlan``), ``spec`` (reading specs),
``presets`` (``PROFILES``), ``distributions`` (the delay distributions), ``client_factors``
(tiers, speed), ``job_draws`` (delays, Raspberry-Pi latencies), ``raspberry_pi`` (ORTHOFL's
table and pooled statistics), ``dropout``, ``partial_work``, ``components`` (what they share),
``trace_replay`` (replayed traces), ``checks`` (value checks) and ``streams`` (seeding).
"""

from .presets import PROFILES, Preset
from .profile import JobPlan, Profile, make_profile
from .raspberry_pi import RASPBERRY_PI_PROFILES, RPI_POOLED

__all__ = [
    "PROFILES",
    "RASPBERRY_PI_PROFILES",
    "RPI_POOLED",
    "JobPlan",
    "Preset",
    "Profile",
    "make_profile",
]
