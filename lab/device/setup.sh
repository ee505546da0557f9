# Source from the repository root on a GPU machine where megaserve is not pip-installed:
#   source lab/device/setup.sh
# comm/, kernels/, planner/ and deploy/ install as megaserve.comm, ... (pyproject's
# package-dir); without an install, links inside megaserve/ give the same import names
# (this copy of the tree only: never commit them). Sets PYTHONPATH to the repository root,
# unbuffered output and MEGASERVE_CACHE (default /tmp/msc) for generated checkpoints.
for d in comm kernels planner deploy; do
    [ -e "megaserve/$d" ] || ln -s "../$d" "megaserve/$d"
done
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export MEGASERVE_CACHE="${MEGASERVE_CACHE:-/tmp/msc}"
