# Sourced by the GPU run scripts (gpu-bringup.sh, gpu-real-size.sh) with MODEL set to a model
# directory on the disk under test and SUM to the summary file: CUDA's libraries where cudarc
# looks for them, cuFile's configuration (compatibility mode allowed where nvidia-fs is absent,
# logs in CUFILE_LOGS) and, on a VM disk without udev data, the two properties cuFile reads.
# shellcheck source=scripts/cuda-libs.sh
. "$(dirname "${BASH_SOURCE[0]}")/cuda-libs.sh" >/tmp/gdsllm-culibs.txt
tee -a "$SUM" </tmp/gdsllm-culibs.txt
CUFILE_LOGS=${CUFILE_LOGS:-/tmp/cufile-logs}
mkdir -p "$CUFILE_LOGS"
cat >/tmp/cufile.json <<JSON
{ "logging": { "dir": "$CUFILE_LOGS", "level": "INFO" },
  "properties": { "allow_compat_mode": true } }
JSON
export CUFILE_ENV_PATH_JSON=/tmp/cufile.json
# cuFile classifies a file's filesystem through udev; a VM disk without udev data (seen on a
# Firecracker H200: "udev property not found: ID_FS_USAGE vda") makes cuFileHandleRegister
# fail even in compatibility mode. Give the model's block device the two properties cuFile
# reads (root only; says so). Only on a machine with the NVIDIA driver and libcufile.
DEV=$(stat -c '%d' "$MODEL" 2>/dev/null) && MAJMIN="$((DEV >> 8)):$((DEV & 255))"
if [ -e /proc/driver/nvidia/version ] && [ -e "$CUDA_LINKS/libcufile.so" ] && [ -n "${MAJMIN:-}" ] &&
  [ ! -e "/run/udev/data/b$MAJMIN" ] && mkdir -p /run/udev/data 2>/dev/null; then
  FSTYPE=$(df --output=fstype "$MODEL" | tail -1)
  printf 'E:ID_FS_USAGE=filesystem\nE:ID_FS_TYPE=%s\n' "$FSTYPE" >"/run/udev/data/b$MAJMIN"
  echo "udev data for block device $MAJMIN was missing: wrote ID_FS_USAGE=filesystem, ID_FS_TYPE=$FSTYPE" | tee -a "$SUM"
fi
